#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/kestrel/indigo/g' pine.txt
