#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/maple/quartz/g' delta.txt
