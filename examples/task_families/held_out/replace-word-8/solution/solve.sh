#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/cedar/nutmeg/g' glacier.txt
