// Command kubenode hosts the Kubernetes components of kuscale's end-to-end node in one binary:
// etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the kubelet and kubectl, each
// run as its own process by naming it first, so the tests build one program from the
// Kubernetes modules, at one release, and start each part with the flags its own
// documentation gives.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	kubectl "k8s.io/kubectl/pkg/cmd"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllers "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: kubenode etcd|kube-apiserver|kube-controller-manager|"+
			"kube-scheduler|kubelet|kubectl [flags]")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var command *cobra.Command
	args := os.Args[2:]
	switch os.Args[1] {
	case "etcd":
		os.Exit(runEtcd(ctx, args))
	case "kube-apiserver":
		command = apiserver.NewAPIServerCommand()
	case "kube-controller-manager":
		command = controllers.NewControllerManagerCommand()
	case "kube-scheduler":
		command = scheduler.NewSchedulerCommand()
	case "kubelet":
		command = kubelet.NewKubeletCommand(ctx)
	case "kubectl":
		// kubectl reads os.Args itself (for its plugins): it sees the command line it
		// would see as a program of its own.
		os.Args = os.Args[1:]
		command = kubectl.NewDefaultKubectlCommand()
	default:
		fmt.Fprintf(os.Stderr, "kubenode: no component %q\n", os.Args[1])
		os.Exit(2)
	}
	command.SetArgs(args)
	os.Exit(cli.Run(command))
}
