// Package e2e holds the Go client's end-to-end tests: the real attnserve binary (CPU backend
// unless $ATTNSERVE_BACKEND says otherwise) on loopback, driven through package attnserve and
// checked against package reference. They skip when the binary is missing ($ATTNSERVE_BIN,
// default <repo>/build/release/bin/attnserve).
package e2e
