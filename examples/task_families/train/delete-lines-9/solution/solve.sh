#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/maple/d' amber.txt
