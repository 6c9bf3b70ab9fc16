#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/apple/quartz/g' jasper.txt
