#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/min(xs)/max(xs)/' largest.py
