#!/bin/bash
# The reference solution, run in /app.
set -e
mv zephyr.txt pepper.txt
