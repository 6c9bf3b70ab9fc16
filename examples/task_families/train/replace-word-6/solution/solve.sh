#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/quartz/nectar/g' jasper.txt
