#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/saffron/d' maple.txt
