#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'birch nutmeg' > glacier.txt
