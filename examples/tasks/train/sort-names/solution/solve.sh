#!/bin/bash
# The reference solution, run in /app.
set -e
sort names.txt > sorted.txt
