#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/saffron/maple/g' basil.txt
