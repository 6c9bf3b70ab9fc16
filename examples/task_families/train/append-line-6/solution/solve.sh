#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'falcon nectar' >> river.txt
