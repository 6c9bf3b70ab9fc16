#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/nectar/d' indigo.txt
