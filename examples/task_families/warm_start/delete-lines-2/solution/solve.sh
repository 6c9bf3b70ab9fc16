#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/falcon/d' maple.txt
