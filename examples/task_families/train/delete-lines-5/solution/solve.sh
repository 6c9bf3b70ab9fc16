#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/basil/d' delta.txt
