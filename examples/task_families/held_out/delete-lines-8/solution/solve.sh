#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/cedar/d' hazel.txt
