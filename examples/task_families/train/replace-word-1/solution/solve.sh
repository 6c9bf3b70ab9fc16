#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/indigo/nectar/g' kestrel.txt
