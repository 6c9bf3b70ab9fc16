#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'lotus willow' > onyx.txt
