#!/bin/bash
# The reference solution, run in /app.
set -e
sort -u visits.txt | wc -l > unique.txt
