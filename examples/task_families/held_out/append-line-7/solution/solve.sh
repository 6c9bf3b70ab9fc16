#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'zephyr lemon' >> onyx.txt
