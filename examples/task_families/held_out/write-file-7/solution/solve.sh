#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'lemon yarrow' > cedar.txt
