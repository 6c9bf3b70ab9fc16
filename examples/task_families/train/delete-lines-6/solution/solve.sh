#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/juniper/d' copper.txt
