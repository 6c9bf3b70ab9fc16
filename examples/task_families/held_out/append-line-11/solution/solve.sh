#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'glacier lemon' >> cedar.txt
