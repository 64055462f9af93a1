// The Go client as a module, for builds with module downloads: run `go mod tidy` once to
// write go.sum, after generating the stubs into gen/ (env.sh go_generate, or go.sh). The
// offline build (test.sh, go.sh) runs in GOPATH mode over Debian's packaged sources, which
// ignores this file; the versions below are the ones Debian 12 ships and that build uses.
module attnserve/client/go

go 1.19

require (
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)
