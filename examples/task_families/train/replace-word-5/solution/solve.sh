#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/maple/juniper/g' nectar.txt
