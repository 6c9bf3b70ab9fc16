#!/bin/bash
# The reference solution, run in /app.
set -e
mv falcon.txt maple.txt
