#!/bin/bash
# The reference solution, run in /app.
set -e
mv amber.txt basil.txt
