#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'river pine' > basil.txt
