#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'saffron apple' > maple.txt
