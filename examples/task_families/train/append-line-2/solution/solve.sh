#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'quartz apple' >> maple.txt
