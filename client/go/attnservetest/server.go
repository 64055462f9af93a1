// Package attnservetest starts a real attnserve server process for integration tests, in the
// spirit of net/http/httptest:
//
//	func TestSomething(t *testing.T) {
//		srv := attnservetest.StartT(t, `pools { name: "gqa" kind: POOL_KIND_GQA num_layers: 2
//			page_size: 16 num_qo_heads: 8 num_kv_heads: 2 head_dim: 64 num_pages: 256 }`)
//		client, err := attnserve.Dial(srv.Address)
//		...
//	}
//
// The binary is $ATTNSERVE_BIN, or <repo>/build/release/bin/attnserve when this package sits in
// the attnserve repository; StartT skips the test when it does not exist. The backend is
// $ATTNSERVE_BACKEND (default cpu).
package attnservetest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Timeouts of Start and Stop.
const (
	StartupTimeout  = 60 * time.Second
	ShutdownTimeout = 30 * time.Second
)

// ErrNoBinary is returned (wrapped) by Start when the server binary does not exist.
var ErrNoBinary = errors.New("attnserve binary not found")

var listening = regexp.MustCompile(`^attnserve listening on (\S+)$`)

// Server is a running attnserve process.
type Server struct {
	Address string // host:port it listens on
	Backend string
	Binary  string

	cmd     *exec.Cmd
	dir     string // temporary: the config and the server's stderr
	exited  chan struct{}
	exitErr error
	stopped bool
}

// Binary returns the server binary: $ATTNSERVE_BIN, else the repository's release build. The
// error wraps ErrNoBinary when the file does not exist.
func Binary() (string, error) {
	path := os.Getenv("ATTNSERVE_BIN")
	if path == "" {
		root, err := repoRoot()
		if err != nil {
			return "", fmt.Errorf("%w: set ATTNSERVE_BIN (%v)", ErrNoBinary, err)
		}
		path = filepath.Join(root, "build", "release", "bin", "attnserve")
	}
	if st, err := os.Stat(path); err != nil || st.IsDir() {
		return "", fmt.Errorf("%w at %s: build it (cmake --preset release && cmake --build "+
			"--preset release) or set ATTNSERVE_BIN", ErrNoBinary, path)
	}
	return path, nil
}

// repoRoot is the attnserve repository this file belongs to (through any GOPATH symlink).
func repoRoot() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("no caller information")
	}
	real, err := filepath.EvalSymlinks(file)
	if err != nil {
		return "", err
	}
	root := filepath.Join(filepath.Dir(real), "..", "..", "..") // attnservetest, go, client
	if _, err := os.Stat(filepath.Join(root, "proto", "attnserve", "v1", "attention.proto")); err != nil {
		return "", fmt.Errorf("%s is not the attnserve repository", root)
	}
	return root, nil
}

// Start runs the server with a text-format ServerConfig on 127.0.0.1:0 (metrics off) and waits
// until it listens. extraArgs are appended to the command line (e.g. "--cpu_threads=2").
func Start(config string, extraArgs ...string) (*Server, error) {
	binary, err := Binary()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "attnservetest-")
	if err != nil {
		return nil, err
	}
	configPath := filepath.Join(dir, "server.textproto")
	if err := os.WriteFile(configPath, []byte(config), 0o644); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	backend := os.Getenv("ATTNSERVE_BACKEND")
	if backend == "" {
		backend = "cpu"
	}
	args := append([]string{
		"--listen_address=127.0.0.1:0",
		"--backend=" + backend,
		"--metrics_port=0",
		"--config=" + configPath,
	}, extraArgs...)
	stderr, err := os.Create(filepath.Join(dir, "stderr.log"))
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	defer stderr.Close()
	cmd := exec.Command(binary, args...)
	cmd.Stderr = stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("starting %s: %w", binary, err)
	}
	s := &Server{Backend: backend, Binary: binary, cmd: cmd, dir: dir, exited: make(chan struct{})}

	address := make(chan string, 1)
	go func() {
		// Reads stdout to the end so the server never blocks on a full pipe.
		sc := bufio.NewScanner(stdout)
		found := false
		for sc.Scan() {
			if m := listening.FindStringSubmatch(sc.Text()); m != nil && !found {
				found = true
				address <- m[1]
			}
		}
		_, _ = io.Copy(io.Discard, stdout)
		s.exitErr = cmd.Wait()
		close(s.exited)
	}()
	select {
	case s.Address = <-address:
		return s, nil
	case <-s.exited:
		err = fmt.Errorf("attnserve exited before listening (%v): %s %s\n%s", s.exitErr, binary,
			strings.Join(args, " "), s.LogTail(40))
	case <-time.After(StartupTimeout):
		_ = cmd.Process.Kill()
		<-s.exited
		err = fmt.Errorf("no 'attnserve listening on' line within %v: %s %s\n%s", StartupTimeout,
			binary, strings.Join(args, " "), s.LogTail(40))
	}
	os.RemoveAll(dir)
	return nil, err
}

// StartT is Start for tests: it skips tb when the binary is missing, fails it when the server
// does not start, and stops the server at the end of the test (failing it unless the server
// exits 0 on SIGTERM).
func StartT(tb testing.TB, config string, extraArgs ...string) *Server {
	tb.Helper()
	s, err := Start(config, extraArgs...)
	if errors.Is(err, ErrNoBinary) {
		tb.Skip(err)
	}
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := s.Stop(); err != nil {
			tb.Error(err)
		}
	})
	return s
}

// Stop sends SIGTERM and waits for the server to drain and exit; an error unless it exits 0
// within ShutdownTimeout (then it is killed). Stop is not safe for concurrent use; a second
// Stop is a no-op.
func (s *Server) Stop() error {
	if s.stopped {
		return nil
	}
	s.stopped = true
	select {
	case <-s.exited:
		return s.cleanup(fmt.Errorf("attnserve had exited before Stop (%v):\n%s", s.exitErr,
			s.LogTail(40)))
	default:
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.exited:
		if s.exitErr != nil {
			return s.cleanup(fmt.Errorf("attnserve exited with %v after SIGTERM:\n%s", s.exitErr,
				s.LogTail(40)))
		}
		return s.cleanup(nil)
	case <-time.After(ShutdownTimeout):
		_ = s.cmd.Process.Kill()
		<-s.exited
		return s.cleanup(fmt.Errorf("attnserve ignored SIGTERM for %v", ShutdownTimeout))
	}
}

func (s *Server) cleanup(err error) error {
	if s.dir != "" {
		os.RemoveAll(s.dir)
		s.dir = ""
	}
	return err
}

// LogTail is the last lines of the server's stderr.
func (s *Server) LogTail(lines int) string {
	if s.dir == "" {
		return ""
	}
	data, _ := os.ReadFile(filepath.Join(s.dir, "stderr.log"))
	all := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}
