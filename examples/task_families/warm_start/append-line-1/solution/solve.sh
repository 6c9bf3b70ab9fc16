#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'velvet river' >> nectar.txt
