#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'velvet river' > falcon.txt
