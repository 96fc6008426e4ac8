#!/usr/bin/env bash
# Builds examples/go offline with Debian's Go packages (GOPATH mode, no module downloads):
#   apt-get install golang-go protobuf-compiler libprotobuf-dev golang-google-protobuf-dev \
#     golang-google-grpc-dev golang-google-genproto-dev golang-lukechampine-blake3-dev
# (libprotobuf-dev has the well-known types, /usr/include/google/protobuf/*.proto)
# protoc-gen-go and protoc-gen-go-grpc are built from the sources those packages ship,
# the stubs generated from proto/ into a work directory, and the client built there.
#
#   examples/go/build.sh WORKDIR      # writes WORKDIR/bin/shardledger-go
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="$(mkdir -p "${1:?usage: build.sh WORKDIR}" && cd "$1" && pwd)"
# The build cache stays where Go keeps it (~/.cache/go-build), so a rebuild is quick.
export GO111MODULE=off GOFLAGS= GOPATH="$work:/usr/share/gocode"
export GOPROXY=off GOTOOLCHAIN=local CGO_ENABLED=0
mkdir -p "$work/bin" "$work/src/shardledger.dev/examples/shardledger-go"
[ -x "$work/bin/protoc-gen-go" ] || go build -o "$work/bin/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
[ -x "$work/bin/protoc-gen-go-grpc" ] || go build -o "$work/bin/protoc-gen-go-grpc" google.golang.org/grpc/cmd/protoc-gen-go-grpc
# go_package in ledger.proto places the stubs at shardledger.dev/api/shardledger/v1.
PATH="$work/bin:$PATH" protoc -I "$root/proto" -I /usr/include \
  --go_out="$work/src" --go-grpc_out="$work/src" "$root/proto/shardledger/v1/ledger.proto"
cp "$here"/*.go "$work/src/shardledger.dev/examples/shardledger-go/"
go build -o "$work/bin/shardledger-go" shardledger.dev/examples/shardledger-go
echo "$work/bin/shardledger-go"
