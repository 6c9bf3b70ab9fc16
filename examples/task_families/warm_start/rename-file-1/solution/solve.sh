#!/bin/bash
# The reference solution, run in /app.
set -e
mv pine.txt jasper.txt
