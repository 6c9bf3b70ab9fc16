#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'amber juniper' >> falcon.txt
