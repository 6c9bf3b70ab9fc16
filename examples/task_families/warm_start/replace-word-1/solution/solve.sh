#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/velvet/river/g' falcon.txt
