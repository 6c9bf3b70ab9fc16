#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/lotus/nutmeg/g' cedar.txt
