#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'sage willow' > cobalt.txt
