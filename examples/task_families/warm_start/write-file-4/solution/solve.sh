#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'basil falcon' > maple.txt
