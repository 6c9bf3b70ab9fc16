#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'apple maple' > orchid.txt
