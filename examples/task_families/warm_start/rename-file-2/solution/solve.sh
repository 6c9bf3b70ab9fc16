#!/bin/bash
# The reference solution, run in /app.
set -e
mv kestrel.txt basil.txt
