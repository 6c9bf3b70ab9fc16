#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'orchid apple' >> basil.txt
