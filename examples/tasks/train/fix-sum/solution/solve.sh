#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/range(n)/range(n + 1)/' total.py
