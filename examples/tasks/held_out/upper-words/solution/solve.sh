#!/bin/bash
# The reference solution, run in /app.
set -e
tr a-z A-Z < words.txt > upper.txt
