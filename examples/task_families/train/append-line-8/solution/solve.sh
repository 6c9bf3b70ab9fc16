#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'pine orchid' >> tundra.txt
