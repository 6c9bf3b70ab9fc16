#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'sage iris' >> nutmeg.txt
