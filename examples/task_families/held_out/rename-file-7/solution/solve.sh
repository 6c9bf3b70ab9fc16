#!/bin/bash
# The reference solution, run in /app.
set -e
mv willow.txt lotus.txt
