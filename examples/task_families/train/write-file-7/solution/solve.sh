#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'basil apple' > jasper.txt
