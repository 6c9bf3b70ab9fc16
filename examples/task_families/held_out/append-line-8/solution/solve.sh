#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'meadow hazel' >> umber.txt
