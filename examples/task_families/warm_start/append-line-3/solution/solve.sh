#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'maple amber' >> quartz.txt
