#!/bin/bash
# The reference solution, run in /app.
set -e
mv yarrow.txt willow.txt
