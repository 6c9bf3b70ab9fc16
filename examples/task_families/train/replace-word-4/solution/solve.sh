#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/jasper/delta/g' pine.txt
