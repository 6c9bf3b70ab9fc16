#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'delta orchid' > pine.txt
